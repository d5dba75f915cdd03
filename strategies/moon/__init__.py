"""MOON (Li et al. 2021): FedAvg plus a model-contrastive term on each hospital's representation."""

from common.methods.registry import MethodSpec

METHODS = (
    MethodSpec("moon", ("classification",), server="strategies.moon.server:MoonServer",
               hospital="strategies.moon.hospital:MoonHospital", strategy="strategies.moon.strategy:MoonStrategy",
               summary="FedAvg with a model-contrastive term on the representation",
               settings="strategies.moon.settings:MoonSettings", section="moon", model_needs="features",
               secure="common.trust.secure_aggregation.methods:MEAN_UPDATE",
               privacy="common.methods.privacy:MODEL_UPDATE_WITH_TERM"),
)
