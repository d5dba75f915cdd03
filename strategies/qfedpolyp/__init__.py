"""QFedPolyp (docs/qfedpolyp.md): quantisation-aware training, per-hospital bit-widths, bit-width-tagged packed
payloads (``common/quantization``), FedAvg of the rebuilt models, and an INT8 model for inference."""

from common.methods.registry import MethodSpec

METHODS = (
    MethodSpec("qfedpolyp", ("polyp-segmentation", "classification"),  # the first: QFedPolypStrategy()'s task
               server="strategies.qfedpolyp.server:QFedPolypServer",
               hospital="strategies.qfedpolyp.hospital:QFedPolypHospital",
               strategy="strategies.qfedpolyp.strategy:QFedPolypStrategy",
               summary="Quantisation-aware training, per-hospital b-bit packed uploads, FedAvg",
               settings="strategies.qfedpolyp.settings:QFedPolypSettings", section="qfedpolyp",
               model_needs="quantisable",
               not_for_central_dp="a reply is the model's b-bit quantised codes (uint8 data, ranges, header), not its "
               "weights, so there is no update for the wrapper to clip", secure="strategies.qfedpolyp.secure:SECURE",
               privacy="strategies.qfedpolyp.privacy:RULES"),
)
