# Writes OUT, a C++ source defining efdl::dashboard::kPageHtml with the bytes of IN (the page),
# so the binary serves it without any file beside it.
file(READ ${IN} page)
string(FIND "${page}" ")EFDL_PAGE\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw-string delimiter )EFDL_PAGE\"")
endif()
file(WRITE ${OUT}.tmp "// Generated from src/dashboard/page.html by embed_page.cmake; do not edit.\n"
     "namespace efdl::dashboard {\nextern const char kPageHtml[];\n"
     "const char kPageHtml[] = R\"EFDL_PAGE(${page})EFDL_PAGE\";\n}  // namespace efdl::dashboard\n")
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.tmp)
