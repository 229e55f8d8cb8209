"""Tokenization and incremental detokenization with stop strings (`detokenizer`), and the tokenizer
process (`worker`)."""
