"""What a FedProIn message carries besides the model (Flower's DP wrappers clip every ArrayRecord of a reply as
model weights, so the rest travels as metrics and config)."""

#: reply metric holding the influence matrix, flattened row by row (classes x prototypes per class): a list of
#: counts travels in the reply's MetricRecord, so the reply's only ArrayRecord is the model.
INFLUENCE = "influence"
#: round-config key: flat indices (class * M + k) of the prototypes a hospital re-seeds before training
RESEED = "fedproin-reseed"
