"""fxpipe.ir."""
