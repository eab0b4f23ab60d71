"""Model families the app knows, each with its config, its HF mapping and its TP plan."""
