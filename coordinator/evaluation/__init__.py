"""Generation quality: an MNIST classifier we trust, conditional accuracy and FID in its feature space."""
