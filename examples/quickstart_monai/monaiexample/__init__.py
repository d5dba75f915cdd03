"""monaiexample: A Flower / MONAI app."""
