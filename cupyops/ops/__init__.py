"""One module per op family: spec -> plan -> launch -> public functions."""
