// Declarations-only stand-in for <objc/message.h>: the untyped dispatch
// entry points that metal-cpp casts to each message's signature.
#pragma once

#include <objc/runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

void objc_msgSend(void);
void objc_msgSend_fpret(void);
void objc_msgSend_stret(void);

#ifdef __cplusplus
}
#endif
