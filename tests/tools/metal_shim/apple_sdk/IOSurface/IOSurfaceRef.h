// Declarations-only stand-in for <IOSurface/IOSurfaceRef.h>.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
