"""fxpipe.base."""
