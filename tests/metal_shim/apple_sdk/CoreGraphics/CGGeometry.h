// Declarations-only stand-in for <CoreGraphics/CGGeometry.h>.
#pragma once

typedef double CGFloat;
struct CGSize {
  CGFloat width;
  CGFloat height;
};
typedef struct CGSize CGSize;
