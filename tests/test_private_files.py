"""Files and folders another local user could plant: a secret file, the socket folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.bearer import read_secret
from engine.tiers.client import _foreign_socket_folder
from tierstore.auth import AccessError, private_dir


def test_a_secret_file_of_another_user_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("x" * 32)
    assert read_secret(secret) == b"x" * 32
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(secret, 65534, 65534)  # whoever made the file would have chosen the secret
    with pytest.raises(ValueError, match="belongs to uid 65534"):
        read_secret(secret)


def test_the_engine_does_not_connect_through_a_folder_others_can_write(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    address = f"unix:{folder}/tierstore.sock"
    assert _foreign_socket_folder(address) is None
    folder.chmod(0o777)
    assert "not a private folder" in (_foreign_socket_folder(address) or "")
    folder.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(folder)
    assert "not a private folder" in (_foreign_socket_folder(f"unix:{link}/tierstore.sock") or "")
    assert _foreign_socket_folder("127.0.0.1:50061") is None


def test_a_symlinked_socket_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    private_dir(real, fix=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    private_dir(link, fix=True)  # the disk tier may live behind a link
    with pytest.raises(AccessError, match="symbolic link"):
        private_dir(link, fix=True, follow_symlinks=False)
