// Declarations-only stand-in for <CoreGraphics/CGColorSpace.h>.
#pragma once

typedef struct CGColorSpace* CGColorSpaceRef;
