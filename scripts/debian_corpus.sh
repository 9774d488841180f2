#!/usr/bin/env bash
# The two corpora of at least 110 MB each, built offline from Debian 12's packages (no install):
#   code   about 180 MB of Python: the standard library and the sources of Debian's python3-* libraries
#   prose  about 115 MB of English documentation: the manuals and guides of Debian's -doc packages
# Downloads the packages' .debs with apt-get download into WORK, unpacks them there, writes their
# versions to OUT.packages.txt, runs make_corpus.py on their folders (its filters: one copy of each
# file, prose that is mostly words, an HTML page's article alone), and packs OUT as OUT.tar.xz for
# the GPU machine (prose about 26 MB, code about 31 MB).
#
#   bash scripts/debian_corpus.sh code|prose OUT [WORK]        # WORK defaults to /tmp/corpus-debs-KIND
set -euo pipefail
kind=${1:?usage: debian_corpus.sh code|prose OUT [WORK]}
out=${2:?usage: debian_corpus.sh code|prose OUT [WORK]}
work=${3:-/tmp/corpus-debs-$kind}
here=$(cd "$(dirname "$0")" && pwd)
root=$work/root
d=$root/usr/share/doc
r=$d/rust-doc/html
case $kind in
  code)
    packages=(libpython3.11-stdlib python3-django python3-sympy python3-scipy python3-numpy python3-pandas
              python3-sklearn python3-matplotlib python3-astropy python3-sqlalchemy python3-twisted
              python3-networkx python3-sphinx python3-docutils python3-statsmodels python3-skimage python3-mypy
              python3-nltk python3-dask python3-distributed python3-pygments python3-jedi python3-tornado)
    roots=("$root/usr/lib/python3.11" "$root/usr/lib/python3/dist-packages") ;;
  prose)
    packages=(linux-doc-6.1 python3.11-doc python-django-doc python-sqlalchemy-doc postgresql-doc-15 git-doc
              debian-handbook python-scipy-doc python-pandas-doc perl-doc octave-doc ruby3.1-doc gnuplot-doc
              gnucash-docs gimp-help-en python-sklearn-doc python-astropy-doc cmake-doc sphinx-doc
              libreoffice-help-en-us rust-doc maxima-doc scons-doc bash-doc python-flask-doc python-werkzeug-doc)
    roots=("$d/linux-doc-6.1" "$d/python3.11" "$d/python-django-doc" "$d/python-sqlalchemy-doc"
           "$d/postgresql-doc-15" "$d/git-doc" "$d/debian-handbook/html/en-US" "$d/python-scipy-doc"
           "$d/python-pandas-doc" "$root/usr/share/perl" "$d/octave" "$d/octave-doc" "$d/ruby3.1-doc"
           "$d/gnuplot-doc" "$d/gnucash-docs/gnucash-guide-en" "$d/gnucash-docs/gnucash-help-en"
           "$root/usr/share/gimp" "$d/python-sklearn-doc" "$d/python-astropy-doc" "$d/cmake-doc" "$d/sphinx-doc"
           "$root/usr/share/libreoffice/help" "$r/book" "$r/edition-guide" "$r/embedded-book" "$r/nomicon"
           "$r/reference" "$r/rust-by-example" "$r/rustc" "$r/rustdoc" "$r/unstable-book" "$r/std"
           "$d/maxima-doc" "$d/scons" "$d/bash" "$d/python-flask-doc" "$d/python-werkzeug-doc") ;;
  *) echo "debian_corpus.sh: the kind is code or prose, got $kind" >&2; exit 2 ;;
esac
mkdir -p "$work/debs" "$root"
(cd "$work/debs" && apt-get download "${packages[@]}")
for deb in "$work"/debs/*.deb; do
  dpkg-deb -x "$deb" "$root"
  dpkg-deb -f "$deb" Package Version | paste -sd= | sed 's/Package: //; s/=Version: /=/'
done | sort > "$out.packages.txt"
python3 "$here/make_corpus.py" "$out" --kind "$kind" --min-bytes 1.1e8 --roots "${roots[@]}"
tar -C "$(dirname "$out")" -cJf "$out.tar.xz" "$(basename "$out")"
ls -l "$out.tar.xz"
