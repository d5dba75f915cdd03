"""QFedPolyp's settings: the ``[qfedpolyp]`` run-config table and ``QFedPolypStrategy``'s own arguments."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from common.settings import Section


class QFedPolypSettings(Section):
    """QFedPolyp (docs/qfedpolyp.md): each hospital's uplink bit-width, the downlink's, QAT on/off, and beyond the
    paper what is sent (weights or updates, dense or sparse; the model or its change down) with error feedback."""

    bit_widths: str = Field("8", description="Uplink bit-width per hospital in name order, e.g. '8,8,8,16,16'; "
                                             "one value: every hospital. Each 2..16, or 32 for plain floats. "
                                             "A hospital's node config 'bit-width' wins over this list. 1: "
                                             "signs with a scale per tensor (quantise='update' only).")
    downlink_bit_width: int = Field(32, description="Bit-width of the global model sent to hospitals "
                                                    "(32: plain floats; 1: signs, downlink='delta' only).")
    qat: bool = Field(True, description="Fake-quantise weights to the hospital's bit-width in local training "
                                        "(quantise='weights'; updates are quantised after full-precision training).")
    quantise: Literal["weights", "update"] = Field("weights", description=(
        "What a hospital sends at its bit-width: its trained weights (the paper's), or its round's update "
        "(trained minus received weights, far narrower per tensor); BatchNorm statistics then go as floats."))
    error_feedback: bool = Field(False, description=(
        "quantise='update': a hospital adds what quantisation (and sparsification) lost last time to its next "
        "update (kept in its state folder)."))
    sparsity: float = Field(1.0, description=(
        "quantise='update': the fraction of each tensor's entries a hospital sends (1.0: all, dense); the rest "
        "is carried by error feedback. Tensors of fewer than 1024 entries always go whole."))
    sparsify: Literal["top-k", "random-k"] = Field("top-k", description=(
        "Which entries a sparse update or downlink keeps: the largest in magnitude, or a seeded random draw."))
    downlink: Literal["model", "delta"] = Field("model", description=(
        "What the server sends: the global model at downlink-bit-width ('model'), or the change of the model "
        "hospitals hold since they last received it ('delta', at downlink-bit-width and downlink-sparsity; what "
        "it does not carry is sent later; a hospital that missed a round gets the full model)."))
    downlink_sparsity: float = Field(1.0, description=(
        "downlink='delta': the fraction of each tensor's entries the downlink delta carries (1.0: all)."))
    downlink_low_rank_bits: float = Field(0.0, ge=0.0, description=(
        "downlink='delta', dense: send each matrix-shaped tensor of the delta as its best rank-r factors at "
        "downlink-bit-width, r chosen so the factors take at most this many bits per entry (as low-rank-bits does "
        "for updates; what they leave out is sent later); 0: off."))
    statistics_bit_width: int = Field(32, description=(
        "quantise='update' and downlink='delta': the bit-width of the BatchNorm running statistics that travel "
        "beside the update or delta (32: the floats; 2..16: per tensor min-max, the minimum exact)."))
    low_rank_bits: float = Field(0.0, ge=0.0, description=(
        "quantise='update', dense: send each matrix-shaped tensor of the update as its best rank-r factors at the "
        "hospital's bit-width, r chosen so the factors take at most this many bits per entry of the tensor "
        "(e.g. 0.4); 0: off."))
    server_learning_rate: float = Field(1.0, gt=0.0, le=10.0, description=(
        "quantise='update': the server adds this many times the hospitals' weighted mean update to the global "
        "model (FedOpt's server learning rate; 1: FedAvg). Above 1, a larger step for what compressed updates "
        "defer to later rounds (error feedback); measured in docs/qfedpolyp.md."))
    train_from: Literal["received", "own"] = Field("received", description=(
        "error-feedback=true: where a hospital's local training starts. 'received': the global model it received "
        "(its residual is added to the trained change); 'own': the received model plus its residual, the model "
        "it would hold had all its updates arrived (CHOCO-SGD's local copy), so training goes on from there "
        "instead of redoing what is still waiting to be sent."))
    sparse_block: int = Field(1, ge=1, le=4096, description=(
        "Sparse updates and deltas: send whole blocks of this many consecutive entries (of each flattened tensor), "
        "the blocks of largest norm, so a position costs 1/block of its bits and more entries fit in the same "
        "bytes (sparsity is then the fraction of blocks kept); 1: single entries."))

    @model_validator(mode="after")
    def _feedback_needs_updates(self) -> "QFedPolypSettings":
        if self.error_feedback and self.quantise != "update":
            raise ValueError("qfedpolyp.error-feedback=true needs qfedpolyp.quantise='update'")
        if self.sparsity < 1.0 and self.quantise != "update":
            raise ValueError(f"qfedpolyp.sparsity={self.sparsity:g} needs qfedpolyp.quantise='update' (weights "
                             "cannot be sent in part)")
        if self.sparse_block > 1 and self.sparsity >= 1.0 and self.downlink_sparsity >= 1.0:
            raise ValueError(f"qfedpolyp.sparse-block={self.sparse_block} needs qfedpolyp.sparsity < 1 or "
                             "qfedpolyp.downlink-sparsity < 1 (nothing is sent sparse)")
        if self.statistics_bit_width < 32 and self.quantise != "update" and self.downlink != "delta":
            raise ValueError(f"qfedpolyp.statistics-bit-width={self.statistics_bit_width} needs "
                             "qfedpolyp.quantise='update' or qfedpolyp.downlink='delta' (otherwise the statistics "
                             "travel inside the model, at its bit-width)")
        if 1 in self.bit_width_list and self.quantise != "update":
            raise ValueError(f"qfedpolyp.bit-widths={self.bit_widths!r}: 1 bit (signs with a scale) needs "
                             "qfedpolyp.quantise='update' (a round's change; weights need 2 bits or more)")
        if self.downlink_bit_width == 1 and self.downlink != "delta":
            raise ValueError("qfedpolyp.downlink-bit-width=1 (signs with a scale) needs qfedpolyp.downlink='delta' "
                             "(the model's change; the model itself needs 2 bits or more)")
        if self.low_rank_bits:
            if self.quantise != "update" or self.sparsity < 1.0:
                raise ValueError(f"qfedpolyp.low-rank-bits={self.low_rank_bits:g} needs qfedpolyp.quantise='update' "
                                 "and sparsity=1 (low-rank factors of the whole update)")
            if not all(2 <= bits < 32 and self.low_rank_bits < bits for bits in self.bit_width_list):
                raise ValueError(f"qfedpolyp.low-rank-bits={self.low_rank_bits:g}: the factors travel at the "
                                 f"hospitals' bit-widths ({self.bit_widths}), which must be 2..16 and above it")
        if self.train_from == "own" and not self.error_feedback:
            raise ValueError("qfedpolyp.train-from='own' needs qfedpolyp.error-feedback=true (the residual it "
                             "starts from)")
        if self.server_learning_rate != 1.0 and self.quantise != "update":
            raise ValueError(f"qfedpolyp.server-learning-rate={self.server_learning_rate:g} needs "
                             "qfedpolyp.quantise='update' (the server scales the hospitals' mean update)")
        if self.downlink_low_rank_bits:
            if self.downlink != "delta" or self.downlink_sparsity < 1.0:
                raise ValueError(f"qfedpolyp.downlink-low-rank-bits={self.downlink_low_rank_bits:g} needs "
                                 "qfedpolyp.downlink='delta' and downlink-sparsity=1 (factors of the whole delta)")
            if not 2 <= self.downlink_bit_width < 32 or self.downlink_low_rank_bits >= self.downlink_bit_width:
                raise ValueError(f"qfedpolyp.downlink-low-rank-bits={self.downlink_low_rank_bits:g}: the factors "
                                 f"travel at downlink-bit-width ({self.downlink_bit_width}), which must be 2..16 "
                                 "and above it")
        if self.downlink_sparsity < 1.0 and self.downlink != "delta":
            raise ValueError(f"qfedpolyp.downlink-sparsity={self.downlink_sparsity:g} needs "
                             "qfedpolyp.downlink='delta' (the global model cannot be sent in part)")
        return self

    @field_validator("sparsity", "downlink_sparsity", "low_rank_bits", "downlink_low_rank_bits", "server_learning_rate",
                     mode="before")
    @classmethod
    def _number(cls, value):
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value  # sparsity=1

    @field_validator("sparsity", "downlink_sparsity")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{value!r} is not a fraction of entries kept: use a number in (0, 1], 1 for all")
        return value

    @field_validator("bit_widths", mode="before")
    @classmethod
    def _single_number(cls, value):
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value  # bit-widths=8

    @field_validator("bit_widths")
    @classmethod
    def _bit_width_list(cls, value: str) -> str:
        from common.quantization.codec import check_bit_width

        items = [item.strip() for item in value.split(",")]
        if not all(item.lstrip("-").isdigit() for item in items):
            raise ValueError(f"{value!r} is not a comma-separated list of integers such as '8,8,8,16,16'")
        for item in items:
            check_bit_width(int(item), f"bit-width {item}")
        return ",".join(items)

    @field_validator("downlink_bit_width")
    @classmethod
    def _downlink(cls, value: int) -> int:
        from common.quantization.codec import check_bit_width

        return check_bit_width(value, "downlink bit-width")

    @field_validator("statistics_bit_width")
    @classmethod
    def _statistics(cls, value: int) -> int:
        from common.quantization.codec import check_bit_width

        return check_bit_width(value, "statistics bit-width", content="weights")

    @property
    def bit_width_list(self) -> list[int]:
        return [int(item) for item in self.bit_widths.split(",")]
