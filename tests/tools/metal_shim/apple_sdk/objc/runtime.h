// Declarations-only stand-in for <objc/runtime.h>: what metal-cpp uses.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef struct objc_class* Class;
// Complete, as in Apple's objc.h: NS::Object derives from it.
struct objc_object {
  Class isa;
};
typedef struct objc_object* id;
typedef struct objc_selector* SEL;
typedef struct objc_object Protocol;

SEL sel_registerName(const char* name);
Class objc_lookUpClass(const char* name);
Protocol* objc_getProtocol(const char* name);

#ifdef __cplusplus
}
#endif
