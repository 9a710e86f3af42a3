"""fxpipe.params."""
