"""The script PyInstaller freezes: every role of npu-proxy in one executable."""

from npu_proxy.supervisor.frozen import main

if __name__ == "__main__":
    main()
