"""Convert the shared Llama checkpoint to an f32 GGUF with llama.cpp's own converter.

Run by a peer venv's python (it needs torch, sentencepiece and numpy; the project venv
lacks sentencepiece): ``python _peers_gguf.py TEXT_DIR OUT.gguf CONVERTER``. The converter
knows SentencePiece vocabularies, not our WordLevel one, so a SentencePiece model with the
same 32,000 pieces (``<unk> <s> </s> w3 ...``, ids equal) is written beside links to the
weights in a scratch dir, and the converter runs there. Standalone on purpose: it cannot
import the project.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VOCAB = 32000
SPECIALS = ("<unk>", "<s>", "</s>")


def write_sentencepiece(path: Path) -> None:
    """A unigram SentencePiece model whose id ``i`` is the WordLevel vocab's id ``i``."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    proto = spm.ModelProto()
    proto.trainer_spec.model_type = spm.TrainerSpec.UNIGRAM
    proto.trainer_spec.vocab_size = VOCAB
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
    proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    kind = spm.ModelProto.SentencePiece
    for i in range(VOCAB):
        p = proto.pieces.add()
        special = i < len(SPECIALS)
        p.piece = SPECIALS[i] if special else f"\u2581w{i}"
        p.score = 0.0 if special else -float(i)
        p.type = (kind.UNKNOWN if i == 0 else kind.CONTROL) if special else kind.NORMAL
    path.write_bytes(proto.SerializeToString())


def main(argv: list[str]) -> int:
    """Convert ``argv[0]`` (an HF Llama dir) to ``argv[1]`` with converter ``argv[2]``."""
    src, out, converter = Path(argv[0]), Path(argv[1]), Path(argv[2])
    with tempfile.TemporaryDirectory(prefix="peers-gguf-") as tmp:
        work = Path(tmp)
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            if (src / name).exists():
                (work / name).symlink_to(src / name)
        write_sentencepiece(work / "tokenizer.model")
        part = out.with_name(out.name + ".part")
        cmd = [
            sys.executable,
            str(converter),
            str(work),
            "--outtype",
            "f32",
            "--outfile",
            str(part),
        ]
        # The converter imports the gguf package from its own source tree.
        gguf_py = str(converter.parent / "gguf-py")
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([gguf_py, os.environ.get("PYTHONPATH", "")])
        )
        subprocess.run(cmd, check=True, env=env)
        shutil.move(str(part), str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
