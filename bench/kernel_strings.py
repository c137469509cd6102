"""Write or print every kernel string's sha256 (testsupport/kernel_inventory.py says what and why).

    python bench/kernel_strings.py [out.json]     # prints the JSON when no path is given
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # testsupport/ is not installed

from testsupport.kernel_inventory import kernel_strings  # noqa: E402

if __name__ == "__main__":
    text = json.dumps(kernel_strings(), indent=1) + "\n"
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text)
    else:
        sys.stdout.write(text)
