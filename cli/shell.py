"""What a shell command line runs, and with which environment: read as a shell would, for the
checks of `ray up` files (cli/deploy.py).

``;``, ``&&``, ``|``, ``&``, subshells, ``if``/loops, ``sh -c``, ``export``, ``unset``, ``cd``,
``VAR=x cmd``, ``env``, ``sudo``, ``nohup``/``exec``/``timeout``, quotes, ``~`` and known ``$VAR``
are followed; where a shell is not sure what ran (a chain, a pipeline), the reading is strict.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Invocation:
    """One simple command of a shell command line: its words after assignments and wrappers
    (``nohup``, ``exec``, ``env``...), the exported environment it runs with, and the last ``cd``."""
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str | None


_OPS = ("&&", "||", ";;", ";", "|", "&", "\n", "(", ")")
_OPEN, _CLOSE = ("if", "while", "until", "case", "for", "select"), ("fi", "done", "esac")
_PREFIX = {"nohup", "exec", "command", "builtin", "setsid", "time", "then", "do", "else", "elif", "{", "}", "!"}


def _tokens(text: str) -> Iterator[str]:
    """Words (quotes kept, ``$(...)`` and backticks whole) and the operators of ``_OPS``."""
    i, n, word = 0, len(text), ""
    while i < n:
        ch = text[i]
        if ch in "'\"":
            j = text.index(ch, i + 1) if ch == "'" else _dquote_end(text, i)
            word += text[i:j + 1]
            i = j + 1
        elif ch == "\\":
            word += text[i:i + 2]
            i += 2
        elif text.startswith("$(", i) or ch == "`":
            j = _subst_end(text, i)
            word += text[i:j]
            i = j
        elif ch in "<>":  # a redirection: `2>&1`, `>>`, `<&0` stay one word
            j = i + 1 + (text[i + 1:i + 2] in ("&", ">"))
            word, i = word + text[i:j], j
        elif ch in " \t":
            if word:
                yield word
            word, i = "", i + 1
        elif ch == "#" and not word:
            while i < n and text[i] != "\n":
                i += 1
        else:
            op = next((o for o in _OPS if text.startswith(o, i)), None)
            if op is None or (op == ")" and word):  # `pattern)` of a case, a word's own parenthesis
                word, i = word + ch, i + 1
                continue
            if word:
                yield word
            yield op
            word, i = "", i + len(op)
    if word:
        yield word


def _without_redirections(words: list[str]) -> list[str]:
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif re.match(r"^\d*(>>?|<)&?", w):
            skip = re.fullmatch(r"\d*(>>?|<)&?", w) is not None  # the target is the next word
        else:
            out.append(w)
    return out


def _dquote_end(text: str, i: int) -> int:
    j = i + 1
    while text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j


def _subst_end(text: str, i: int) -> int:
    if text[i] == "`":
        return text.index("`", i + 1) + 1
    depth, j = 0, i + 1
    while True:
        ch = text[j]
        if ch in "'\"":
            j = (text.index(ch, j + 1) if ch == "'" else _dquote_end(text, j)) + 1
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        j += 1
        if depth == 0:
            return j


def _unquote(word: str, shell_vars: dict[str, str]) -> str:
    """The word as the program sees it: quotes removed, ``~`` and known ``$VAR`` expanded (an unknown
    one, a ``$(...)`` or backticks stay as written: `_program` then cannot name the program)."""
    out, i = "", 0
    if word.startswith("~"):
        out, i = "~", 1
    while i < len(word):
        ch = word[i]
        if ch == "'":
            j = word.index("'", i + 1)
            out += word[i + 1:j]
            i = j + 1
        elif ch == '"':
            j = _dquote_end(word, i)
            out += _expand(re.sub(r'\\([$`"\\])', r"\1", word[i + 1:j]), shell_vars)
            i = j + 1
        elif ch == "\\":
            out += word[i + 1:i + 2]
            i += 2
        else:
            j = i
            while j < len(word) and word[j] not in "'\"\\":
                j += 1
            out += _expand(word[i:j], shell_vars)
            i = j
    return out


def _expand(text: str, shell_vars: dict[str, str]) -> str:
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: shell_vars.get(m[1] or m[2], m[0]), text)


def invocations(command: str, env: dict[str, str] | None = None, cwd: str | None = None) -> list[Invocation]:
    """Every simple command ``command`` runs, each with the environment it gets (``env``: the one
    the shell starts with). Strict where a shell is not sure: an ``export`` only counts after the
    first command of an ``&&``/``||`` chain, inside its subshell, ``if``/loop body or pipeline part."""
    try:
        toks = list(_tokens(command))
    except (ValueError, IndexError):
        raise ValueError("cannot read it as a shell would: an unbalanced quote or $(...)") from None
    reader = _Reader(env, cwd)
    cmd: list[str] = []
    for tok in toks:
        if tok == "(":
            reader.push()
        elif tok == ")":
            reader.run(cmd, ";")
            cmd = []
            reader.pop()
        elif tok in _OPS:
            reader.run(cmd, tok)
            cmd = []
        else:
            cmd.append(tok)
    reader.run(cmd, ";")
    return reader.out


class _Reader:
    """A command line's state as a shell reads it, one simple command at a time (``invocations``):
    the environment, the shell's variables and the directory, saved per subshell or block."""

    def __init__(self, env: dict[str, str] | None, cwd: str | None) -> None:
        self.out: list[Invocation] = []
        self.env = dict(env or {})
        self.shell = dict(self.env)  # variables for expansion: exported or not
        self.cwd = cwd
        self.stack: list[tuple[dict, dict, str | None]] = []  # saved (env, shell, cwd) per subshell / block
        self.chain_first: tuple[dict, dict, str | None] | None = None  # the state after a chain's first command
        self.prev = ";"

    def push(self) -> None:
        self.stack.append((dict(self.env), dict(self.shell), self.cwd))

    def pop(self) -> None:
        if self.stack:
            self.env, self.shell, self.cwd = self.stack.pop()

    def run(self, words: list[str], sep: str) -> None:
        """One simple command's words, ended by the operator ``sep``."""
        scoped = sep in ("|", "&") or self.prev == "|"  # a pipeline part or a background job: its own subshell
        self.prev = sep
        words = _without_prefix(_without_redirections(words))
        e, sh, d = (dict(self.env), dict(self.shell), self.cwd) if scoped else (self.env, self.shell, self.cwd)
        if words and words[0] in _OPEN:
            self.push()
            words = [] if words[0] in ("case", "for", "select") else _without_prefix(words[1:])
        if words and words[0] in _CLOSE:
            self.pop()
            return
        d = self._simple(words, e, sh, d)
        if not scoped:
            self.env, self.shell, self.cwd = e, sh, d
        if sep in ("&&", "||"):
            if self.chain_first is None:
                self.chain_first = (dict(self.env), dict(self.shell), self.cwd)
        elif self.chain_first is not None:  # the chain ends: only its first command surely ran
            self.env, self.shell, self.cwd = self.chain_first
            self.chain_first = None

    def _simple(self, words: list[str], e: dict[str, str], sh: dict[str, str], d: str | None) -> str | None:
        """Assignments, ``export``/``unset``/``cd`` (into ``e``, ``sh``), or a program run (into
        ``out``); returns the directory after it."""
        local = {}
        while words and re.match(r"^\w+=", words[0]):
            k, _, v = words.pop(0).partition("=")
            local[k] = _unquote(v, sh)
        if not words:  # plain assignments: shell variables (exported ones change the environment)
            sh.update(local)
            e.update({k: v for k, v in local.items() if k in e})
            return d
        argv = [_unquote(w, sh) for w in words]
        if argv[0] == "export":
            for a in argv[1:]:
                k, eq, v = a.partition("=")
                e[k] = v if eq else sh.get(k, "")
                sh[k] = e[k]
        elif argv[0] == "unset":
            for k in argv[1:]:
                e.pop(k, None)
                sh.pop(k, None)
        elif argv[0] == "cd":
            d = argv[1] if len(argv) > 1 else "~"
        else:
            self.out.extend(_wrapped(argv, {**e, **local}, d))
        return d


def _without_prefix(words: list[str]) -> list[str]:
    """``words`` without the keywords and wrappers before a command (``nohup``, ``then``, ``{``...)."""
    while words and words[0] in _PREFIX:
        words = words[1:]
    return words


def _wrapped(argv: list[str], env: dict[str, str], cwd: str | None) -> list[Invocation]:
    """``argv`` through its wrappers: ``env [-i] [-u N] [K=V]... cmd``, ``sudo`` (a clean environment),
    ``timeout``/``nice``, ``sh -c STRING`` (read as a command line of its own, with the environment)."""
    while argv:
        name = posixpath.basename(argv[0])
        if name in _PREFIX or name == "stdbuf":
            argv = [a for a in argv[1:] if not (name == "stdbuf" and a.startswith("-"))]
        elif name == "env":
            argv = argv[1:]
            while argv and (argv[0].startswith("-") or "=" in argv[0]):
                a = argv.pop(0)
                if a in ("-i", "-", "--ignore-environment"):
                    env = {}
                elif a in ("-u", "--unset") and argv:
                    env = {k: v for k, v in env.items() if k != argv.pop(0)}
                elif "=" in a and not a.startswith("-"):
                    k, _, v = a.partition("=")
                    env = {**env, k: v}
        elif name == "sudo":  # sudo resets the environment (env_reset) but for what it is told
            argv = argv[1:]
            keep = any(a in ("-E", "--preserve-env") for a in argv if a.startswith("-"))
            env = env if keep else {}
            while argv and (argv[0].startswith("-") or "=" in argv[0]):
                a = argv.pop(0)
                if "=" in a and not a.startswith("-"):
                    k, _, v = a.partition("=")
                    env = {**env, k: v}
                elif a in ("-u", "-g", "-C", "-D", "-h", "-p", "-R", "-T", "-U") and argv:
                    argv.pop(0)
        elif name in ("timeout", "nice"):
            argv = argv[1:]
            while argv and (argv[0].startswith("-") or re.match(r"^[\d.]+[smhd]?$", argv[0])):
                argv.pop(0)
        elif name in ("sh", "bash", "dash", "zsh") and len(argv) > 1:
            flags = [a for a in argv[1:] if a.startswith("-")]
            rest = argv[1 + len(flags):]
            if any("c" in f for f in flags) and rest:
                return invocations(rest[0], env, cwd)
            break
        else:
            break
    return [Invocation(tuple(argv), env, cwd)] if argv else []
