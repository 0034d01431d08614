"""Tables and figures from Parquet alone (no torch): the report spec, the tables, figures, ratios and the run
comparison."""
