"""Make a published asv dashboard work with no network: serve its scripts and styles from the published folder.

    python -m fp8rl.perf.asv_offline .asv/html            # after `asv publish` (nox -s asv / nightly run it)

asv 0.6.6's ``index.html`` loads jQuery, flot (and its time/selection/categories/orderBars plugins), Bootstrap,
stupidtable and blueimp-md5 from public CDNs; offline (an air-gapped lab, a CI artifact opened later) none of them
loads and the page shows only "Can not determine continental origin of swallow". This post-publish step

1. copies each of those files from the npm packages installed by ``npm ci`` in ``perf/asv_vendor/`` (exact
   versions in its package-lock.json, with their registry integrity hashes — nothing is downloaded here or when the
   page is viewed) into ``<html>/vendor/<package>/<path>`` (Bootstrap's fonts too, beside its CSS);
2. rewrites every CDN ``<script src>`` / ``<link href>`` of the published pages to the local copy, dropping the
   ``integrity``/``crossorigin`` attributes (they pin the CDN's own minified builds; the local copies are pinned by
   the lock instead);
3. adds a Content-Security-Policy that allows only the folder's own origin, so anything still pointing outside
   fails loudly in the browser instead of silently;
4. refuses (exit 1, naming it) any external script or stylesheet it has no local copy for, and any installed
   package whose version is not the one the lock names.

The versions are asv's (``ASSETS``) except stupidtable: the npm registry has only stupid-table-plugin 1.1.3, the
same plugin and API as the 1.0.1 that asv takes from cdnjs. Running it twice is harmless (nothing left to rewrite).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

VENDOR_DIR = Path(__file__).resolve().parent / "asv_vendor"
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; font-src 'self' data:; connect-src 'self'")


@dataclass(frozen=True)
class Asset:
    """A CDN file of asv's index.html and where the npm package holds the same library."""

    url: str  # as it appears in asv 0.6.6's index.html
    package: str  # npm package in perf/asv_vendor/package.json
    path: str  # file inside the package
    extra: tuple[str, ...] = ()  # other paths of the package the file refers to (copied alongside)


ASSETS: tuple[Asset, ...] = (
    Asset("https://code.jquery.com/jquery-3.3.1.min.js", "jquery", "dist/jquery.min.js"),
    Asset("https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.min.js", "flot", "jquery.flot.js"),
    Asset("https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.time.min.js", "flot", "jquery.flot.time.js"),
    Asset("https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.selection.min.js", "flot",
          "jquery.flot.selection.js"),
    Asset("https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot.categories.min.js", "flot",
          "jquery.flot.categories.js"),
    Asset("https://cdn.jsdelivr.net/npm/flot-orderbars@1.0.0/js/jquery.flot.orderBars.js", "flot-orderbars",
          "js/jquery.flot.orderBars.js"),
    Asset("https://cdnjs.cloudflare.com/ajax/libs/stupidtable/1.0.1/stupidtable.min.js", "stupid-table-plugin",
          "stupidtable.min.js"),
    Asset("https://cdnjs.cloudflare.com/ajax/libs/blueimp-md5/2.19.0/js/md5.min.js", "blueimp-md5", "js/md5.min.js"),
    Asset("https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/js/bootstrap.min.js", "bootstrap",
          "dist/js/bootstrap.min.js"),
    Asset("https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css", "bootstrap",
          "dist/css/bootstrap.min.css",
          extra=tuple(f"dist/fonts/glyphicons-halflings-regular.{ext}" for ext in ("eot", "svg", "ttf", "woff"))),
)

_TAG = re.compile(r"<(script|link)\b[^>]*>", re.IGNORECASE)
_URL_ATTR = re.compile(r"""\b(src|href)\s*=\s*(["'])(https?:)?//[^"']*\2""", re.IGNORECASE)
_DROP_ATTRS = re.compile(r"""\s+(integrity|crossorigin|referrerpolicy)(\s*=\s*(["'])[^"']*\3)?""", re.IGNORECASE)


class OfflineError(RuntimeError):
    """The dashboard cannot be made offline (a missing vendor package, a version mismatch, an unknown CDN file)."""


def locked_versions(vendor: Path = VENDOR_DIR) -> dict[str, str]:
    """package -> version, from perf/asv_vendor/package-lock.json."""
    lock = json.loads((vendor / "package-lock.json").read_text())
    return {name.removeprefix("node_modules/"): meta["version"] for name, meta in lock["packages"].items()
            if name.startswith("node_modules/")}


def check_installed(modules: Path, vendor: Path = VENDOR_DIR) -> dict[str, str]:
    """Every package the assets need is installed under ``modules`` at its locked version; returns the versions."""
    want = locked_versions(vendor)
    problems = []
    for pkg in sorted({a.package for a in ASSETS}):
        meta = modules / pkg / "package.json"
        if not meta.is_file():
            problems.append(f"{pkg}: not installed under {modules} (run: npm ci --ignore-scripts --prefix {vendor})")
            continue
        got = json.loads(meta.read_text()).get("version")
        if got != want.get(pkg):
            problems.append(f"{pkg}: installed {got}, package-lock.json says {want.get(pkg)}")
    if problems:
        raise OfflineError("vendor packages: " + "; ".join(problems))
    return {pkg: want[pkg] for pkg in sorted({a.package for a in ASSETS})}


def local_path(asset: Asset, path: str | None = None) -> str:
    """Where a copied file lies, relative to the published folder."""
    return f"vendor/{asset.package}/{path or asset.path}"


def _rewrite_tag(tag: str, by_url: dict[str, Asset], unknown: list[str]) -> str:
    m = _URL_ATTR.search(tag)
    if not m:
        return tag
    url = m.group(0).split("=", 1)[1].strip()[1:-1]
    if tag.lower().startswith("<link") and not re.search(r"""rel\s*=\s*["']?stylesheet""", tag, re.IGNORECASE):
        return tag  # a plain link (icon, canonical) loads nothing that the page needs
    asset = by_url.get(url)
    if asset is None:
        unknown.append(url)
        return tag
    q = m.group(2)
    tag = tag[: m.start()] + f"{m.group(1)}={q}{local_path(asset)}{q}" + tag[m.end():]
    return _DROP_ATTRS.sub("", tag)


def rewrite_html(text: str) -> tuple[str, list[str]]:
    """(the page with every known CDN script/stylesheet pointing at its local copy and a CSP added, the external
    URLs it has no copy for)."""
    by_url = {a.url: a for a in ASSETS}
    unknown: list[str] = []
    out = _TAG.sub(lambda m: _rewrite_tag(m.group(0), by_url, unknown), text)
    if "Content-Security-Policy" not in out:
        out = re.sub(r"(<head\b[^>]*>)", lambda m: m.group(1) + f'\n    <meta http-equiv="Content-Security-Policy" '
                     f'content="{CSP}">', out, count=1, flags=re.IGNORECASE)
    return out, unknown


def make_offline(html_dir: str | Path, modules: str | Path | None = None, vendor: Path = VENDOR_DIR) -> dict:
    """Copy the assets into ``html_dir``/vendor and rewrite its pages; returns what was done (for the log)."""
    html_dir = Path(html_dir)
    if not (html_dir / "index.html").is_file():
        raise OfflineError(f"html_dir: {html_dir} has no index.html (run asv publish first)")
    mods = Path(modules) if modules is not None else vendor / "node_modules"
    versions = check_installed(mods, vendor)
    copied = []
    for a in ASSETS:
        for path in (a.path, *a.extra):
            src, dst = mods / a.package / path, html_dir / local_path(a, path)
            if not src.is_file():
                raise OfflineError(f"{a.package} {versions[a.package]}: has no {path}")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            copied.append(str(dst.relative_to(html_dir)))
    rewritten, unknown = [], []
    for page in sorted(html_dir.glob("*.html")):
        text = page.read_text(encoding="utf-8")
        new, missing = rewrite_html(text)
        unknown += [f"{page.name}: {u}" for u in missing]
        if new != text:
            page.write_text(new, encoding="utf-8")
            rewritten.append(page.name)
    if unknown:
        raise OfflineError("external scripts/stylesheets with no local copy (add them to ASSETS and "
                           "perf/asv_vendor/package.json): " + ", ".join(unknown))
    return {"html_dir": str(html_dir), "versions": versions, "copied": copied, "rewritten": rewritten}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp8rl.perf.asv_offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("html_dir", help="the folder asv publish wrote (html_dir of perf/asv.conf.json: .asv/html)")
    ap.add_argument("--node-modules", default=None,
                    help=f"where the vendor packages are installed (default {VENDOR_DIR / 'node_modules'})")
    args = ap.parse_args(argv)
    try:
        done = make_offline(args.html_dir, args.node_modules)
    except (OfflineError, OSError, ValueError) as exc:
        print(f"asv_offline: {exc}", file=sys.stderr)
        return 1
    print(f"asv_offline: {len(done['copied'])} files from "
          + ", ".join(f"{p} {v}" for p, v in done["versions"].items())
          + f" into {done['html_dir']}/vendor; rewrote {', '.join(done['rewritten']) or 'nothing (already offline)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
