"""After training: the evaluation gate, export to the registry, and promotion by alias. The KFP
components and the CLI steps are thin shells over these functions."""
