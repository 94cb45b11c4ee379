"""A stand-in for Argo's executor binary (`argoexec`, emissary executor), for the cluster's Argo
step pods. The kubelet runs it as the `argoexec` image; the first line (a shebang naming this
machine's Python) is written when the image layer is made.

  argoexec init       copy itself to /var/run/argo/argoexec (as Argo's init container does) and
                      download the template's input artifacts (ARGO_TEMPLATE) from S3 into
                      /argo/inputs/artifacts/NAME (folders, not archives)
  argoexec wait       the `wait` sidecar: end once main's exit code is written (output artifacts
                      are not uploaded: not modelled)
  argoexec emissary -- CMD...
                      main's wrapper: run CMD, forward SIGTERM, write its exit code for `wait`
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

ARGO = "/var/run/argo"
EXIT_FILE = f"{ARGO}/ctr/main/exitcode"


def init() -> None:
    shutil.copy(os.path.realpath(__file__), f"{ARGO}/argoexec")
    os.chmod(f"{ARGO}/argoexec", 0o755)
    template = json.loads(os.environ.get("ARGO_TEMPLATE", "{}"))
    for artifact in (template.get("inputs") or {}).get("artifacts") or []:
        s3 = artifact["s3"]
        import fsspec

        fs = fsspec.filesystem("s3", anon=True, endpoint_url=s3["endpoint"])
        dest = f"/argo/inputs/artifacts/{artifact['name']}"
        os.makedirs(dest, exist_ok=True)
        for path in fs.find(f"{s3['bucket']}/{s3['key']}"):
            local = os.path.join(dest, os.path.relpath(path, f"{s3['bucket']}/{s3['key']}"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            fs.get(path, local)
        print(f"argoexec init: artifact {artifact['name']} -> {artifact['path']}", flush=True)


def wait() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while not os.path.exists(EXIT_FILE):
        time.sleep(0.2)
    print(f"argoexec wait: main exited with {open(EXIT_FILE).read()}", flush=True)


def emissary(argv: list[str]) -> None:
    proc = subprocess.Popen(argv)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    code = proc.wait()
    code = 128 - code if code < 0 else code
    os.makedirs(os.path.dirname(EXIT_FILE), exist_ok=True)
    with open(EXIT_FILE, "w") as f:
        f.write(str(code))
    sys.exit(code)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "init":
        init()
    elif command == "wait":
        wait()
    elif command == "emissary":
        emissary(sys.argv[sys.argv.index("--") + 1:])
    else:
        sys.exit(f"argoexec stand-in: unknown command {command}")
