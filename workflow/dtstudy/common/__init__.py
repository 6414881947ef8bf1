"""The shared ground floor: small utilities that every stage uses and that import nothing of the study."""
