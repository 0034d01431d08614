"""Units shared by case names, tables and figures (torch-free)."""

K = 1024   # tokens in one "K" of context: "B1 32K" is one row of 32768 tokens
