"""Models and tokenizers: loading, saving and the bundled small model."""
