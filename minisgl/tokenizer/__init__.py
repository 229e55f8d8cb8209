"""Tokenization and incremental detokenization (`detokenizer`, `stop_matcher`), and the tokenizer
process (`worker`)."""
