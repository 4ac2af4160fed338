"""Layer-wise relevance propagation to parameters (AttnLRP rules) and importance maps."""
