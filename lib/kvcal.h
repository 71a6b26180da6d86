/* kvcal: the installed header. It only gathers the public header of each
 * layer, lowest first:
 *
 *   kvcal_core.h  lib/      errors, models in memory, tokenizers, forward and
 *                           backward passes, perplexity, the compressed
 *                           attention and its latent-cache forward pass
 *   kvformats.h   formats/  models, tokenizers, text, statistics files and
 *                           compressed model directories from and to files
 *   kvcalib.h     calib/    calibration data, statistics, collect, merge,
 *                           decompose, train
 *   kvrt.h        kernels/  the decode-attention runtime (libkvrt)
 *
 * Code inside the library includes its own layer's header and those below
 * it, never this one: the build gives each folder only the include paths it
 * may use, so an include the wrong way fails to compile. */
#ifndef KVCAL_H
#define KVCAL_H

#include "kvcal_core.h"
#include "kvformats.h"
#include "kvcalib.h"
#include "kvrt.h"

#endif
