"""fxpipe.job."""
