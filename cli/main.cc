// reshard: the command-line interface (a thin layer over the engine library).
#include <cstdio>

int main() {
  std::puts("reshard: under construction");
  return 0;
}
