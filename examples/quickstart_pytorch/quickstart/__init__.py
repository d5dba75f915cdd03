"""quickstart: Flower's quickstart-pytorch app, with generated images in place of the CIFAR-10 download."""
