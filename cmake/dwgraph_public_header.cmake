# Copies one public header into the installed layout, include/dwgraph/<dir>/<header>: its
# includes of dwgraph's own directories ("ops/linear.h") become "dwgraph/ops/linear.h", so
# a consumer needs only include/ on its include path and no dwgraph directory name can
# clash with one of its own.
#   cmake -DIN=<source header> -DOUT=<installed-layout header> -DCOMPONENTS=common,ops,... -P
string(REPLACE "," "|" _dirs "${COMPONENTS}")
file(READ "${IN}" _text)
string(REGEX REPLACE "(#[ \t]*include[ \t]+\")(${_dirs})/" "\\1dwgraph/\\2/" _text "${_text}")
file(WRITE "${OUT}" "${_text}")
