/* Constant row counts for kernels whose body is inlined once per count. */
#ifndef KVYARD_ROW_DISPATCH_H
#define KVYARD_ROW_DISPATCH_H

/* Runs CALL(R) with R the compile-time constant 1..8 equal to `rows` (8 for more), so that an always-inlined
 * body keeps one accumulator per row of x in registers. */
#define FOR_CONSTANT_ROWS_UP_TO_8(rows, CALL) \
    switch (rows) {                           \
    case 1: CALL(1); break;                   \
    case 2: CALL(2); break;                   \
    case 3: CALL(3); break;                   \
    case 4: CALL(4); break;                   \
    case 5: CALL(5); break;                   \
    case 6: CALL(6); break;                   \
    case 7: CALL(7); break;                   \
    default: CALL(8); break;                  \
    }

/* The same for at most 6 rows. */
#define FOR_CONSTANT_ROWS_UP_TO_6(rows, CALL) \
    switch (rows) {                           \
    case 1: CALL(1); break;                   \
    case 2: CALL(2); break;                   \
    case 3: CALL(3); break;                   \
    case 4: CALL(4); break;                   \
    case 5: CALL(5); break;                   \
    default: CALL(6); break;                  \
    }

/* The same for at most 4 rows. */
#define FOR_CONSTANT_ROWS_UP_TO_4(rows, CALL) \
    switch (rows) {                           \
    case 1: CALL(1); break;                   \
    case 2: CALL(2); break;                   \
    case 3: CALL(3); break;                   \
    default: CALL(4); break;                  \
    }

#endif
