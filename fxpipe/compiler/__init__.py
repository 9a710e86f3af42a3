"""fxpipe.compiler.pipeline."""
