"""Model definitions. They know nothing of ranks: the same code runs on one node or many."""
