"""Packs one static binary as a container image archive (`docker save` layout) for `ctr images import`.

Used for the node's pause image, which has no registry to come from here:

    python3 hack/single_file_image.py --binary pause --name localhost/goodput/pause:3.4 --out pause.tar
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile


def layer_tar(binary: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tar.gettarinfo(binary, arcname=os.path.basename(binary))
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o755
        info.mtime = 0
        with open(binary, "rb") as f:
            tar.addfile(info, f)
    return buf.getvalue()


def image_archive(binary: str, name: str) -> bytes:
    layer = layer_tar(binary)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Entrypoint": ["/" + os.path.basename(binary)], "User": "65535:65535"},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": f"hack/single_file_image.py {os.path.basename(binary)}"}],
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id.split(":")[1] + "/layer.tar"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [name], "Layers": [layer_name]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for path, data in ((layer_name, layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", required=True, help="the static executable, placed at / in the image")
    parser.add_argument("--name", required=True, help="image reference, e.g. localhost/goodput/pause:3.4")
    parser.add_argument("--out", required=True, help="archive to write")
    args = parser.parse_args()
    with open(args.out, "wb") as f:
        f.write(image_archive(args.binary, args.name))


if __name__ == "__main__":
    main()
