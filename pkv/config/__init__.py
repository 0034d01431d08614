"""The experiment config: schema load, command-line coercion, validation, profile resolution, hashing and freezing."""
