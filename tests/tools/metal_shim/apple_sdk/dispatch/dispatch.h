// Declarations-only stand-in for <dispatch/dispatch.h>: opaque handles.
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
