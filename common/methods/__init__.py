"""What a federated method is made of: its two halves' base classes, the registry of method packages, a
hospital's site, the privacy rules a method declares, and the steps several methods share."""
