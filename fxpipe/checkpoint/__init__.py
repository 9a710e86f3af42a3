"""fxpipe.checkpoint."""
