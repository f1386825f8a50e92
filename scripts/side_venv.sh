# Helpers of the side-venv scripts (scripts/torch_checkpointing_env.sh, scripts/megatron_bridge_env.sh): sourced
# from the repository root, not run.

# side_venv_stamp SCRIPT: the hash a side venv's stamp holds once SCRIPT has set it up (a changed script reruns)
side_venv_stamp() { sha256sum "$1" | cut -c1-16; }

# side_venv_create V: the virtual environment V on .venv's interpreter, with .venv's packages visible through a
# .pth file (the same torch build, not a second download; scripts/foreign_env.sh does the same), and a .gitignore
# inside it, so git ignores it without an entry in the project's .gitignore. Returns 3 when .venv is missing.
side_venv_create() {
    local v="$1" base site pure
    [ -x .venv/bin/python ] || { echo "[$v] .venv is missing: run scripts/setup.sh first" >&2; return 3; }
    base="$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')"
    site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    [ -x "$v/bin/python" ] || "$base/bin/python3" -m venv "$v" || return 3
    echo '*' > "$v/.gitignore"
    pure="$("$v/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$site" > "$pure/oarlock-project-venv.pth"
}

# quiet CMD...: CMD's output without pip's notes about local index folders that lack a package; CMD's exit code
quiet() {
    "$@" 2>&1 | grep -v "is ignored: it is neither a file nor a directory"
    return "${PIPESTATUS[0]}"
}
