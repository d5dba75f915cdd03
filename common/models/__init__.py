"""Networks: MONAI's where they fit, our own where a method needs a particular structure."""
