// Declarations-only stand-in for <mach/mach.h>: the types metal-cpp uses.
#pragma once

typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
