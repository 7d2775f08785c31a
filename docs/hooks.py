"""mkdocs hook: links that leave docs/ (to reports/, examples/, CONTRIBUTING.md) resolve on
GitHub, where the pages are read as plain Markdown, but not in the built site, which holds
docs/ only. In the site they point to the repository (``repo_url``) when mkdocs.yml names one,
else they become the path in the repository, as code."""

from __future__ import annotations

import posixpath
import re

LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 (mkdocs' hook signature)
    here = posixpath.dirname(page.file.src_uri)
    repo = (config.get("repo_url") or "").rstrip("/")

    def outside(m: re.Match) -> str:
        target = posixpath.normpath(posixpath.join("docs", here, m[2]))
        if not target.startswith("../") and not target.startswith("docs/"):
            if repo:
                return f"[{m[1]}]({repo}/blob/main/{target}{m[3] or ''})"
            if target.startswith(m[1].strip("`").rstrip("/")):  # the text names the path
                return m[1]
            return f"{m[1]} (`{target}`)"
        return m[0]

    return LINK.sub(outside, markdown)
