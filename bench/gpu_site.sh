# On the GPU machine, sourced at the start of a command whose call carried what
# bench/gpu_carry.sh made here (.whl, .gpu-cache):
#
#   source bench/gpu_site.sh && bash bench/gpu_record_te.sh "$OUT" tests
#
# installs .whl's wheels into /tmp/mcore (kept while the machine stays warm) and exports
# MCORE_SITE=/tmp/mcore, PYTHONPATH=$MCORE_SITE, MEGAGPT_CACHE_DIR=$PWD/.gpu-cache, and,
# where Transformer Engine was built into /tmp/site (../shared/tools/te-gpu's recipe),
# TE_SITE=/tmp/site. PYTHONPATH leaves TE out: bench/gpu_record_te.sh adds it run by run.
# The records name the commit from the checkout's git; where the machine's copy of .git is
# not the commit whose files it runs (seen: the last landed commit, "+changes"), put
# MEGAGPT_COMMIT=<the commit> in front of the command (bench/run_info.py reads it first).
if [ ! -d /tmp/mcore/megatron ]; then
    ls .whl/*.whl > /dev/null 2>&1 || { echo "error: no .whl/ here: carry it (bash bench/gpu_carry.sh makes it)"; return 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/mcore .whl/*.whl 2>&1 | grep -v "^WARNING: Target" || true
fi
export MCORE_SITE=/tmp/mcore PYTHONPATH=/tmp/mcore MEGAGPT_CACHE_DIR=$PWD/.gpu-cache
if [ -d /tmp/site/transformer_engine ]; then export TE_SITE=/tmp/site; fi
python3 -c "import megatron.core as m; print('megatron-core', m.__version__, 'from', m.__path__[0])"
