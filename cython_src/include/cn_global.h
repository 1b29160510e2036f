/* cn_global.h: how a header of the core declares a process-wide variable.
 *
 * Every such variable is declared in the header that uses it (`CN_GLOBAL int64_t x;`) and
 * defined once, with its initial value, in src/cn_globals.c, so the whole extension shares one
 * copy whichever translation units include the header. Hidden visibility keeps the symbols
 * inside the extension's shared object: the core reads them PC-relative, as it would a static,
 * and no other library's symbol of the same name can take their place.
 */
#ifndef CN_GLOBAL_H
#define CN_GLOBAL_H

#define CN_GLOBAL extern __attribute__((visibility("hidden")))

#endif
