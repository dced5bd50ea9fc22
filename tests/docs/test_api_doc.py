"""docs/API.md: every Python block runs, in order, and prints what the page says."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "API.md"


def test_every_api_doc_example_runs_and_is_exact(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    lines = capsys.readouterr().out.splitlines()
    rounds = [ln for ln in lines if ln.startswith("round ")]
    assert len(rounds) == 3
    for ln in rounds:
        assert "accepted [0, 1, 2]" in ln
        assert float(ln.rsplit(" ", 1)[1]) < 1e-5, ln
    assert "0 8 True" in lines
    assert "True num_examples must be a positive integer, got 2.5 (a fraction)" in lines
    # the loop's global model is the hand-computed ideal: every client, after applying
    # its next payload, holds exactly the server's global model
    server, clients, glob = namespace["server"], namespace["clients"], namespace["global_model"]
    from fedexlora.bridge.fold import effective_weight
    from fedexlora.bridge.layers import lora_layers

    for i in range(3):
        namespace["apply_payload"](clients[i], server.payload_for(i))
        for (name, a), (_, b) in zip(lora_layers(clients[i]).items(), lora_layers(glob).items()):
            wa, wb = effective_weight(a), effective_weight(b)
            assert float((wa - wb).norm() / wb.norm()) < 1e-6, name
