"""The zoo's second file layouts: a built model directory laid out as another exporter writes it.

``build_zoo.py`` writes every family as the families' published repos are laid out (the chat
template in ``tokenizer_config.json``). transformers ≥ 4.50 (the zoo's 4.57.6 included) writes it to
``chat_template.jinja`` instead, and optimum-intel's export keeps that file and puts the template
into the tokenizer IR's ``chat_template`` rt_info (which the zoo's IRs hold already): what users'
fresh exports look like. This module derives that layout from a built family, with no torch, so it
runs in the project's ``.venv`` as well as in ``make zoo``::

    .venv/bin/python scripts/zoo_layouts.py        # tests/data/zoo/mistral_nemo -> mistral_nemo_jinja
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ZOO = Path(__file__).resolve().parent.parent / "tests" / "data" / "zoo"
JINJA_LAYOUTS = {"mistral_nemo": "mistral_nemo_jinja"}
"""family -> the directory holding it in transformers 4.57 + optimum-intel's layout."""
LEFT_OUT = {"reference.json"}
"""The zoo's own file, not an export's: without it the directory is no family of the zoo's
conformance tests (its model and tokenizer IRs are the family's, byte for byte)."""


def write_jinja_layout(source: Path, target: Path) -> None:
    """Copy ``source`` (a built family) to ``target`` with the chat template moved out of
    ``tokenizer_config.json`` into ``chat_template.jinja``, as transformers 4.57 saves it; the
    tokenizer IR (template in its rt_info) and the model IR are copied unchanged:
    ``write_jinja_layout(ZOO / "mistral_nemo", ZOO / "mistral_nemo_jinja")``."""
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.pop("chat_template", None)
    if not isinstance(template, str) or not template:
        raise SystemExit(f"{source}/tokenizer_config.json holds no chat_template to move; build the family first")
    if "chat_template" not in (source / "openvino_tokenizer.xml").read_text(encoding="utf-8"):
        raise SystemExit(f"{source}/openvino_tokenizer.xml holds no chat_template rt_info; rebuild the family")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in LEFT_OUT | {"tokenizer_config.json"}:
            shutil.copy2(path, target / path.name)
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    (target / "chat_template.jinja").write_text(template, encoding="utf-8")


def write_layouts(families: list[str]) -> None:
    """The second layout of each of ``families`` that has one (``JINJA_LAYOUTS``)."""
    for family in families:
        if family in JINJA_LAYOUTS:
            write_jinja_layout(ZOO / family, ZOO / JINJA_LAYOUTS[family])
            print(f"{JINJA_LAYOUTS[family]}: {family} with chat_template.jinja (transformers 4.57 layout)", flush=True)


if __name__ == "__main__":
    write_layouts(sys.argv[1:] or list(JINJA_LAYOUTS))
