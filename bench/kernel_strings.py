"""Write or print every kernel string's sha256 (engine/kernels/inventory.py says what and why).

    python bench/kernel_strings.py [out.json]     # prints the JSON when no path is given
"""

from __future__ import annotations

import json
import sys

from engine.kernels.inventory import kernel_strings

if __name__ == "__main__":
    text = json.dumps(kernel_strings(), indent=1) + "\n"
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text)
    else:
        sys.stdout.write(text)
