"""Real text for the language model: a tokenizer, a memory-mapped token file, the corpus preparation, and a
loader whose order is a function of (seed, global sample index) only, so any mesh reads the same batches."""
