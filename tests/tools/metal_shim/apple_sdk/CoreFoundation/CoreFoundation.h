// Declarations-only stand-in for <CoreFoundation/CoreFoundation.h>.
#pragma once

typedef double CFTimeInterval;
